"""`mosaics eval retrieval`; options: --help; guide: docs/evaluation.md."""
import sys

from mosaics.evaluation.cli import main

sys.exit(main(["retrieval", *sys.argv[1:]]))
