import sys

from parallel.cli.memory_probe import main

sys.exit(main())
