"""The decode worker process: `python -m services.decode --model DIR --inbox A --router A --peer A`."""

from services.decode.main import main
from services.exit_now import exit_now

exit_now(main())
