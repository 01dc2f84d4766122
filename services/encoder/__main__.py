"""The vision encoder process:
`python -m services.encoder --model DIR --inbox A --router A --prefill NAME=A`."""

from services.encoder.main import main
from services.exit_now import exit_now

exit_now(main())
