import sys

from parallel.cli.zero import main

sys.exit(main())
