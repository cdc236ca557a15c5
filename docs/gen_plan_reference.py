"""mkdocs-gen-files: the plan reference page, written from the plan's fields at each build."""

import mkdocs_gen_files

from variantbench.plan_reference import render

with mkdocs_gen_files.open("reference/plan.md", "w") as page:
    page.write(render())
