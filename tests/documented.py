"""The commands of README.md, BUILD.md and docs/ as data, for the tests that run them
(tests/test_documented_commands.py checks that every one is run by some test).

A command is a line of a ```bash block, a line of another block that starts with a
program this project ships (docs/results.md's records, docs/gpu.md's device calls), or the
list of a ```yaml block's `command:`. Continuation lines are joined, comments dropped, `&&`
splits one line into two commands; a `run(command="…")` call, `srun`, gcloud's
`--command "…"` and a leading `VAR=value` hand on the command they carry.

A test that runs a documented command takes its words from here (`command(pattern)`), with
the documents' placeholders replaced (`Command.args`), so the command it runs is the one a
reader copies.
"""
import dataclasses
import os
import re
import shlex
import subprocess
from typing import Dict, List, Mapping, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Programs whose lines count as commands in a block that is not marked bash.
PROGRAMS = re.compile(r'(python3? |capsjax(-[a-z]+)?( |$)|bash |pip |make |\.ci/\w|srun |gcloud |tensorboard |'
                      r'export [A-Z]|[A-Z_]+=\S+ |run\(command=)')


def documents() -> List[str]:
  """The tracked Markdown of README.md, BUILD.md and docs/ (the site's generated copies of
  README.md and BUILD.md are not tracked)."""
  tracked = subprocess.run(['git', 'ls-files', 'README.md', 'BUILD.md', 'docs/*.md', 'docs/**/*.md'], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
  return sorted(set(tracked))


@dataclasses.dataclass(frozen=True)
class Command:
  document: str
  line: int
  text: str   # as a reader copies it: continuation lines joined, comment dropped

  @property
  def words(self) -> List[str]:
    return shlex.split(self.text)

  def args(self, placeholders: Optional[Mapping[str, str]] = None) -> List[str]:
    """The words after the program (after `python SCRIPT` for a script), each placeholder
    (a whole word, or the value after `=`) replaced; `[--optional]` words dropped."""
    words = [word for word in self.words if not (word.startswith('[') and word.endswith(']'))]
    start = 2 if words[0] in ('python', 'python3', 'bash') else 1
    if words[:3] == ['python', '-m', 'capsjax']:
      start = 3
    return [_replace(word, placeholders or {}) for word in words[start:]]

  def __str__(self):
    return f'{self.document}:{self.line}: {self.text}'


def _replace(word: str, placeholders: Mapping[str, str]) -> str:
  if word in placeholders:
    return placeholders[word]
  key, equals, value = word.partition('=')
  if equals and value in placeholders:
    return f'{key}={placeholders[value]}'
  return word


def _unwrap(text: str) -> List[str]:
  """The commands one documented line carries."""
  text = text.strip()
  run_call = re.match(r'run\(command="(.*?)"', text)
  if run_call:   # a remote machine's call
    text = run_call.group(1)
  gcloud = re.search(r'--command\s+"(.*)"$', text)
  commands = []
  if gcloud:   # the gcloud line itself is Google's; what it runs on every worker is ours
    text = gcloud.group(1)
  for part in re.split(r'\s+&&\s+', text):
    part = part.strip()
    part = re.sub(r'^(cd \S+)$', '', part)   # `cd capsjax && …`
    part = re.sub(r'^[A-Z_]+=\S+\s+(?=\S)', '', part)   # PYTHONPATH=.gpu-plan capsjax-plan …
    part = re.sub(r'^srun\s+', '', part)
    if part:
      commands.append(part)
  return commands


def _block_lines(body: str, first_line: int) -> List[Tuple[int, str]]:
  """(line, text) of a block's logical lines: continuations joined, comments dropped."""
  lines, pending, start = [], '', None
  for offset, raw in enumerate(body.split('\n')):
    text = raw.strip()
    if not pending and (not text or text.startswith('#')):
      continue
    if start is None:
      start = first_line + offset
    code = re.sub(r'\s+#\s.*$', '', text)   # a trailing comment
    if code.endswith('\\'):
      pending += code[:-1] + ' '
      continue
    lines.append((start, pending + code))
    pending, start = '', None
  return lines


def commands() -> List[Command]:
  found = []
  for document in documents():
    text = open(os.path.join(ROOT, document)).read()
    for block in re.finditer(r'^ *```([^\n]*)\n(.*?)^ *```', text, re.S | re.M):
      language, body = block.group(1).split(' ')[0], block.group(2)
      first_line = text[:block.start()].count('\n') + 2
      if language == 'yaml':
        for listed in re.finditer(r'^command: (\[.*\])$', body, re.M):
          words = [word.strip().strip('"') for word in listed.group(1)[1:-1].split(',')]
          line = first_line + body[:listed.start()].count('\n')
          found.append(Command(document, line, shlex.join(words)))
        continue
      if language not in ('bash', ''):
        continue
      for line, code in _block_lines(body, first_line):
        if language == '' and not PROGRAMS.match(code):
          continue
        found.extend(Command(document, line, part) for part in _unwrap(code))
  return found


def command(pattern: str) -> Command:
  """The one documented command that `pattern` (a regular expression) finds."""
  matches = [found for found in commands() if re.search(pattern, found.text)]
  assert matches, f'no documented command matches {pattern!r}'
  texts = {found.text for found in matches}
  assert len(texts) == 1, f'{pattern!r} matches several documented commands: {sorted(texts)}'
  return matches[0]


def commands_like(pattern: str) -> List[Command]:
  """Every documented command that `pattern` finds (at least one): the same call, several times."""
  matches = [found for found in commands() if re.search(pattern, found.text)]
  assert matches, f'no documented command matches {pattern!r}'
  return matches


def claimed_patterns() -> Dict[str, str]:
  """pattern → test file, for every `documented.command(r'…')` or `documented.commands_like(r'…')`
  in the tests' sources."""
  claimed = {}
  for name in sorted(os.listdir(os.path.join(ROOT, 'tests'))):
    if name.startswith('test_') and name.endswith('.py'):
      source = open(os.path.join(ROOT, 'tests', name)).read()
      for found in re.finditer(r"documented\.command(?:s_like)?\(r?'((?:[^'\\]|\\.)*)'\)", source):
        claimed[found.group(1)] = name
  return claimed
