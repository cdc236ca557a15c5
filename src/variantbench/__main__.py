from variantbench.cli import main

main()
