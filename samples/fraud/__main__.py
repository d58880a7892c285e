"""``python -m samples.fraud`` = ``python -m samples.fraud.run`` (README.md)."""
from .run import main

main()
