"""`mosaics eval empty-rows`; options: --help; guide: docs/evaluation.md."""
import sys

from mosaics.evaluation.cli import main

sys.exit(main(["empty-rows", *sys.argv[1:]]))
