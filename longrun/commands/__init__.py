"""The `longrun` command's sub-commands, one module per noun: runs, hosts, the service processes, advice,
export and config. Each module holds a typer app; longrun/cli.py mounts them."""
