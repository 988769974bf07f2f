import sys

from testenv.cli import main

sys.exit(main())
