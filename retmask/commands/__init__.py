"""Sub-commands of the ``retmask`` command line; each module exposes ``add_parser(subparsers)``."""
