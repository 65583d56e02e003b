"""``python -m kvbridge.router``: the proxy's command line, as ``kvbridge-proxy``."""

from kvbridge.router.proxy import main

main()
