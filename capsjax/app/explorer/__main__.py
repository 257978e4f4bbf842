"""Serve the capsule explorer.

  python -m capsjax.app.explorer [--workdir=W] [--member=K] [--num_images=1000] [--host=127.0.0.1] [--port=8000]

With --workdir, the page explores that run (any CapsNet with a decoder, MNIST-like or
MultiMNIST): its config and latest checkpoint, and its first --num_images test inputs.
Without it, the paper's CapsNet that ships with the package (mnist_official, 0.41 % test error).
"""
import errno
import logging
import signal
import socket
import sys

from capsjax import console
from capsjax.app import cli
from capsjax.errors import CapsjaxError


@cli.main_wrapper
def main(argv=None):
  parser = cli.ArgumentParser(prog='capsjax-explorer', description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', type=cli.existing_workdir, default=None,
                      help='a trained CapsNet run (default: the model shipped with capsjax)')
  parser.add_argument('--member', type=cli.member, default=None,
                      help='ensemble member of an ensemble run (default: the last)')
  parser.add_argument('--num_images', type=cli.int_at_least(1), default=1000,
                      help="test inputs to offer from the run's test set")
  cli.add_data_flags(parser)
  parser.add_argument('--host', default='127.0.0.1', help='address to listen on')
  parser.add_argument('--port', type=cli.int_at_least(0), default=8000, help='port (0: any free one)')
  args = parser.parse_args(argv)
  if args.port > 65535:
    cli.fail(f'capsjax-explorer: --port {args.port} is above 65535')
  logging.getLogger('jax._src.xla_bridge').setLevel(logging.WARNING)
  # Imported after the flags are checked: a typo fails before JAX starts.
  from capsjax.app.explorer.backend import Explorer  # pylint: disable=g-import-not-at-top
  from capsjax.app.explorer.server import make_server, serve_explorer  # pylint: disable=g-import-not-at-top

  if args.workdir is not None:   # a workdir without a run: one line before anything else
    from capsjax.stored_config import read_config  # pylint: disable=g-import-not-at-top
    read_config(args.workdir)
  elif args.member is not None:   # flags that need a workdir: said before the port is taken
    cli.fail('capsjax-explorer: --member needs --workdir (the shipped model is a single run)')
  elif cli.data_overrides(args):
    cli.fail('capsjax-explorer: --data_dir / --tfds_data_dir need --workdir (the shipped model has its images)')
  try:   # bound before the model loads: a busy port or a bad --host is found at once
    server = make_server(None, args.host, args.port)
  except OSError as e:
    raise CapsjaxError(f'cannot listen on {args.host}:{args.port}: {_listen_problem(e)}') from None
  if server.allowed_hosts is None:
    print(f'warning: listening on {args.host}, beyond this machine: anyone who can reach it can use the '
          'explorer', file=sys.stderr, flush=True)
  console.say(f'loading {"the model in " + args.workdir if args.workdir else "the shipped model"}…')
  if args.workdir is None:
    explorer = Explorer.shipped(show_progress=True)
  else:
    explorer = Explorer.from_workdir(args.workdir, args.member, args.num_images, cli.data_overrides(args),
                                     show_progress=True)
  serve_explorer(server, explorer)
  host, port = server.server_address[:2]
  print(f'capsule explorer for {explorer.source} ({explorer.config.experiment}, '
        f'{len(explorer.labels)} test inputs): http://{host}:{port}/  (Ctrl-C stops it)', flush=True)
  for signum in (signal.SIGINT, signal.SIGTERM):   # Ctrl-C (or a service manager's stop) stops serving
    signal.signal(signum, signal.default_int_handler)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    print('stopped', flush=True)
  finally:
    server.server_close()
  return 0


def _listen_problem(error: OSError) -> str:
  if error.errno == errno.EADDRINUSE:
    return 'the port is in use (choose another --port, or 0 for any free one)'
  if isinstance(error, socket.gaierror):
    return 'no such host (check --host; 127.0.0.1 is this machine only)'
  if error.errno == errno.EADDRNOTAVAIL:
    return 'not an address of this machine (check --host)'
  if error.errno == errno.EACCES:
    return 'permission denied (ports below 1024 need root: choose another --port)'
  return error.strerror or str(error)


if __name__ == '__main__':
  cli.run_program(main)
