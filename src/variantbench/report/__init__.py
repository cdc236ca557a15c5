"""The versioned result schema and its renderers (pure functions of the schema)."""

from variantbench.report.schema import SCHEMA_VERSION, Report, RunReport

__all__ = ["SCHEMA_VERSION", "Report", "RunReport"]
