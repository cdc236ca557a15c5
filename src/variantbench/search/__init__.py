"""variantbench search: a multi-objective search for the variants worth deploying (issue 20)."""
