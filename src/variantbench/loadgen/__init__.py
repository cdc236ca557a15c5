"""The load generator: scenarios (issue patterns), the harness and the query log."""
