"""The prefill worker process: `python -m services.prefill --model DIR --inbox A --router A --peer A`."""

from services.prefill.main import main
from services.exit_now import exit_now

exit_now(main())
