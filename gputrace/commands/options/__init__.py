"""Option sets and steps shared by several commands (a package, so the CLI does not list its
modules as commands)."""
