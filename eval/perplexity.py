"""`mosaics eval perplexity`; options: --help; guide: docs/evaluation.md."""
import sys

from mosaics.evaluation.cli import main

sys.exit(main(["perplexity", *sys.argv[1:]]))
