"""Slider-to-image latency of the capsule explorer, measured in headless Chromium.

  python benchmarks/explorer_latency.py [--events=200] [--workdir=W] [--out=latency.json]
                                       [--screenshot=docs/figures/explorer.png]

The page times each reconstruction from the slider's input event (its timeStamp) to the
moment the new image is on the canvas (window.explorerState.latencies). Two patterns:
  single  one key press on a slider, then wait for the image (a careful user);
  drag    input events every 16 ms from a page timer (a drag delivers one per frame), so
          events arrive while a decode is in flight and wait for it (a dragging user).
Also reported: the server's decode alone, and a bare HTTP round trip to /api/decode.
"""
import argparse
import json
import threading
import time
import urllib.request

import numpy as np

from capsjax.app.explorer import browser
from capsjax.app.explorer.backend import Explorer
from capsjax.app.explorer.server import make_server


# A drag: the slider moves 0.005 per event, one event every 16 ms, back and forth.
DRAG = """
window.explorerState.latencies = [];
window.dragDone = false;
const slider = document.getElementById('slider-0-3');
const total = arguments[0];
let k = 0;
const timer = setInterval(() => {
  slider.value = Number(slider.value) + (Math.floor(k / 30) % 2 === 0 ? 0.005 : -0.005);
  slider.dispatchEvent(new Event('input'));
  if (++k >= total) { clearInterval(timer); window.dragDone = true; }
}, 16);
"""


def summary(milliseconds):
  values = np.asarray(milliseconds)
  return {'n': int(len(values)), 'median_ms': round(float(np.median(values)), 2),
          'p95_ms': round(float(np.percentile(values, 95)), 2), 'max_ms': round(float(values.max()), 2)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--events', type=int, default=200)
  parser.add_argument('--workdir', default=None)
  parser.add_argument('--out', default=None)
  parser.add_argument('--screenshot', default=None, help='PNG of the page as it first settles')
  args = parser.parse_args()
  from selenium.webdriver.common.keys import Keys  # pylint: disable=g-import-not-at-top

  explorer = Explorer.from_workdir(args.workdir) if args.workdir else Explorer.shipped()
  server = make_server(explorer, '127.0.0.1', 0)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f'http://127.0.0.1:{server.server_address[1]}'

  vector, cls = explorer.capsules[0, 7], 7
  start = time.perf_counter()
  for _ in range(args.events):
    explorer.decode([vector], [cls])
  decode_ms = (time.perf_counter() - start) / args.events * 1e3
  body = json.dumps({'vectors': [vector.tolist()], 'classes': [cls]}).encode()
  round_trips = []
  for _ in range(args.events):
    start = time.perf_counter()
    request = urllib.request.Request(url + '/api/decode', data=body, headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request) as response:
      response.read()
    round_trips.append((time.perf_counter() - start) * 1e3)

  driver = browser.headless_chromium()
  try:
    driver.get(url + '/')
    browser.wait_for(driver, "document.body.dataset.ready === 'true'")
    browser.settled(driver, 0)
    if args.screenshot:
      driver.save_screenshot(args.screenshot)
    rng = np.random.default_rng(0)
    sliders = driver.find_elements('css selector', '.dim-slider')
    driver.execute_script('window.explorerState.latencies = []')
    for _ in range(args.events):
      renders = driver.execute_script('return window.explorerState.renders')
      sliders[rng.integers(len(sliders))].send_keys(rng.choice([Keys.ARROW_LEFT, Keys.ARROW_RIGHT]))
      browser.settled(driver, renders)
    single = driver.execute_script('return window.explorerState.latencies')
    driver.execute_script(DRAG, args.events)
    browser.wait_for(driver, 'window.dragDone && !window.explorerState.inFlight && !window.explorerState.pending', 120)
    drag = driver.execute_script('return window.explorerState.latencies')
  finally:
    driver.quit()
    server.shutdown()
  results = {
      'model': explorer.source, 'experiment': explorer.config.experiment,
      'server_decode_ms': round(decode_ms, 2),
      'http_round_trip': summary(round_trips),
      'browser_single_event': summary(single),
      'browser_drag': dict(summary(drag), events=args.events, event_interval_ms=16),
  }
  print(json.dumps(results, indent=2))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(results, f, indent=2)


if __name__ == '__main__':
  main()
