"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input: a missing path, an unknown name, an impossible value."""


class ScoringUnavailable(Exception):
    """A served model that cannot score text (no ``/tokenize``, ``echo`` refused): the reason, one line.
    Here, not in ``backends``, because ``metrics.likelihood`` (which must not import backends) catches it."""


class SampleNotScored(Exception):
    """One sample a server refused to score (its prompt and continuation exceed the context): that
    sample is left out, the others scored."""
