import sys

from spoolfs.cli import main

sys.exit(main())
