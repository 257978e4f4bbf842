"""Headless Chromium at the explorer's page, for its browser test and latency benchmark:
Debian's `chromium` and `chromium-driver` (apt-get install chromium chromium-driver) driven
by Selenium (the `test` extra) with an explicit driver path, so nothing is ever downloaded.
Selenium is imported only when a browser starts."""
import os
import shutil
import time

CHROMIUM = os.environ.get('CAPSJAX_CHROMIUM', '/usr/bin/chromium')
CHROMEDRIVER = os.environ.get('CAPSJAX_CHROMEDRIVER', '/usr/bin/chromedriver')


def missing() -> str:
  """Why no browser can start ('' when one can)."""
  for path in (CHROMIUM, CHROMEDRIVER):
    if not (os.path.isfile(path) or shutil.which(path)):
      return f'{path} not found: apt-get install chromium chromium-driver (see .ci/run)'
  return ''


def headless_chromium(width: int = 1340, height: int = 1000):
  from selenium import webdriver  # pylint: disable=g-import-not-at-top
  from selenium.webdriver.chrome.service import Service  # pylint: disable=g-import-not-at-top
  options = webdriver.ChromeOptions()
  options.binary_location = CHROMIUM
  for argument in ('--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage',
                   f'--window-size={width},{height}'):
    options.add_argument(argument)
  return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


def wait_for(driver, script: str, timeout_s: float = 30.0):
  """Polls a JavaScript expression until it is truthy; returns its value."""
  deadline = time.monotonic() + timeout_s
  while True:
    value = driver.execute_script(f'return {script}')
    if value:
      return value
    if time.monotonic() > deadline:
      raise TimeoutError(f'waited {timeout_s:.0f} s for: {script}')
    time.sleep(0.02)


def settled(driver, renders_before: int) -> None:
  """Waits until the page drew a newer reconstruction and has no decode in flight."""
  wait_for(driver, f'window.explorerState.renders > {renders_before} && !window.explorerState.inFlight '
                   '&& !window.explorerState.pending')


def canvas_pixels(driver, canvas_id: str):
  """The R channel of a canvas, row-major (the grey image the page shows)."""
  return driver.execute_script(
      f"const c = document.getElementById('{canvas_id}');"
      "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
      "const out = []; for (let i = 0; i < d.length; i += 4) out.push(d[i]); return out;")
