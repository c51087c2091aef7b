"""`python -m cplm_dist.train`: cplm_dist.train.driver."""

import sys

from cplm_dist.train.driver import main

sys.exit(main())
