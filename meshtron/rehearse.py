"""Rehearse one rank of a layout on this device: `python -m meshtron.rehearse <train.py overrides>
--world N --rank R [--steps S] [--json F]`. The logic lives in `meshtron.training.rehearse`."""

from meshtron.training.rehearse import main

if __name__ == "__main__":
    main()
