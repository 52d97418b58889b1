"""`python -m gputrace` entry point."""

from gputrace.cli import main

main()
