"""One module per command of the CLI: argument handling and output (the work is in the cost model, search, whatif,
tune and the runtime)."""
