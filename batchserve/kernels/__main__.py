"""`python -m batchserve.kernels`: build our CPU kernels now (make setup does), or say why not."""

from batchserve.kernels import main

main()
