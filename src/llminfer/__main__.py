"""``python -m llminfer``: the same entry point as the ``llminfer`` console script."""

from llminfer.cli import main

main()
