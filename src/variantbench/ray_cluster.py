"""Reaching a Ray cluster, for the Ray executor (``pipeline/ray_executor.py``) and the Ray senders
(``loadgen/ray_senders.py``): one address rule, one check, one way to join.

Every node offers one ``variantbench_node`` resource (``ray start --resources
'{"variantbench_node": 1}'``; a local ``ray.init()`` gives itself one): the executor places one
job per node with it, and the senders count the nodes by it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from variantbench.errors import UserError

NODE_RESOURCE = "variantbench_node"


def preflight(address: str | None) -> str | None:
    """Before anything slow: Ray installed, and the cluster's address (if one is given, or in
    RAY_ADDRESS) answering; returns that address (None: a local cluster)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UserError("--executor ray needs Ray: pip install 'variantbench[ray]'") from None
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        _reachable(address)
    return address


def _reachable(address: str) -> None:
    """A cluster address that does not answer fails in one line, at once: Ray itself retries for
    minutes (measured: over 3 minutes for 127.0.0.1:1, then a stack of warnings)."""
    if address in ("auto", "local"):
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3):
            return
    except ValueError:
        raise UserError(f"not a Ray address (host:port or ray://host:port): {address}") from None
    except OSError as exc:
        raise UserError(f"no Ray cluster answers at {address}: {exc.strerror or exc}") from None


def connect(address: str | None) -> int:
    """Join the cluster at ``address`` (None: start a local one of this machine); returns how many
    nodes offer ``NODE_RESOURCE``. Already joined: nothing to do."""
    address = preflight(address)
    import ray

    if not ray.is_initialized():
        kwargs: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": False,
            "configure_logging": False,
        }
        if address is None:  # a local cluster of this one machine: it offers its one slot
            kwargs["resources"] = {NODE_RESOURCE: 1}
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserError(
                f"could not reach the Ray cluster at {address or 'a new local one'}: {exc}"
            ) from None
    slots = int(ray.cluster_resources().get(NODE_RESOURCE, 0))
    if slots < 1:
        raise UserError(
            f"no Ray node offers the {NODE_RESOURCE} resource: start each node with "
            f"ray start --resources '{{\"{NODE_RESOURCE}\": 1}}'"
        )
    return slots


def fingerprint() -> dict[str, Any]:
    """The node this code runs on (inside a Ray task or actor), as the report keeps it."""
    import ray

    from variantbench.environment import cpu_flags, cpu_model, usable_cores

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "host": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": usable_cores(),
        "pid": os.getpid(),
    }
