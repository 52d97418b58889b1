"""One module per CLI command; each exposes ``command`` (a click command or group).

Commands are thin: parse arguments, call the library, print. gputrace/cli.py lists them.
"""
