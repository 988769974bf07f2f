from shared_svc.cli import main

raise SystemExit(main())
