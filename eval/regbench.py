"""`mosaics eval regbench`; options: --help; guide: docs/evaluation.md."""
import sys

from mosaics.evaluation.cli import main

sys.exit(main(["regbench", *sys.argv[1:]]))
