"""`python -m meshtron.plan`: the layout planner's command line, implemented in
`meshtron.training.plan_cli` (it composes the run config as train.py does, so it lives with the
entry; this module is only the `-m` name, an entry point like train.py)."""

from meshtron.training.plan_cli import main

if __name__ == "__main__":
    main()
