import sys

from accelmesh.cli import main

sys.exit(main())
