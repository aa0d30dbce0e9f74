"""How users reach the engine from outside Python: the command line (cli.py, cli_args.py) and the
OpenAI-compatible HTTP server (server/)."""
