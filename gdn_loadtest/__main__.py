"""`python -m gdn_loadtest`: the gdn-loadtest command."""
import sys

from gdn_loadtest.cli import main

sys.exit(main())
