"""The prefill worker process: `python -m services.prefill --model DIR --inbox A --router A --peer A`."""

from services.prefill.main import main

raise SystemExit(main())
