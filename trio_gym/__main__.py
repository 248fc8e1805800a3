import sys

from trio_gym.cli import main

sys.exit(main())
