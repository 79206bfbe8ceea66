"""The command line: argument parsing and output formats. The only layer that calls sys.exit."""
