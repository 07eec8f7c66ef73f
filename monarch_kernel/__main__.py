import sys

from .kernel.kernelspec import main

sys.exit(main())
