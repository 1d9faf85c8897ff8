"""`python -m batchserve.draft`: build the native drafter now (make setup), or say why not."""

from batchserve.draft.native import main

main()
