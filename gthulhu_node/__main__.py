"""`python -m gthulhu_node` is the CLI."""

import sys

from gthulhu_node.cli import main

sys.exit(main())
