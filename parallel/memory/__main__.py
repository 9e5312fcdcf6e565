import sys

from parallel.cli.memory import main

sys.exit(main())
