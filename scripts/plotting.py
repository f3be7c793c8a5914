"""What the plot scripts share: matplotlib without a display, the figure's save, the command line
`plot_X.py SRC.json DST.png`."""
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402,F401 (the plot scripts draw with it)


def save(fig, dst: str):
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def cli(main, doc: str):
    """Runs main(src, dst) from the command line; prints doc (the script's usage) otherwise."""
    if len(sys.argv) != 3:  # --help too
        print(doc)
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    main(*sys.argv[1:3])
