"""The prefill worker process: `python -m services.prefill --model DIR --inbox A --router A --peer A`."""

from services.exit_now import exit_now
from services.prefill.main import main

exit_now(main())
