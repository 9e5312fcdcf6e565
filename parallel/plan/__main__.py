import sys

from parallel.cli.plan import main

sys.exit(main())
