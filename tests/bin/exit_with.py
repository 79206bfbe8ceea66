"""Exit with the code given as the first argument."""

import sys

sys.exit(int(sys.argv[1]))
