"""What each `grpo` command does, a module per concept; flows/cli.py parses the command line and calls them."""
