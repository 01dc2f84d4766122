"""The decode worker process: `python -m services.decode --model DIR --inbox A --router A --peer A`."""

from services.decode.main import main

raise SystemExit(main())
