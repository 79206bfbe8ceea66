"""``python -m bt_agent``: the same program as the ``bt-agent`` console script."""

from bt_agent.cli.main import main

if __name__ == "__main__":
    main()
