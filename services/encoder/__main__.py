"""The vision encoder process:
`python -m services.encoder --model DIR --inbox A --router A --prefill NAME=A`."""

from services.encoder.main import main

raise SystemExit(main())
