"""The explorer page in a real browser (headless Chromium): it loads, a slider moves the
reconstruction to the server-side decode of the perturbed vector, a drawn stroke gets a
prediction, and switching the class capsule decodes that capsule. Never skipped: CI
installs Chromium (.ci/run)."""
import os
import threading

import numpy as np
import pytest

from capsjax.explorer.backend import Explorer, to_pixels
from capsjax.explorer.server import make_server
from capsjax.explorer import browser


@pytest.fixture(scope='module')
def page(tmp_path_factory):
  if browser.missing():
    if os.environ.get('CI') == 'true':   # .ci/run installs the browser: never skipped there
      pytest.fail(browser.missing())
    pytest.skip(f'{browser.missing()}; a system package, skipped outside CI')
  explorer = Explorer.shipped()
  server = make_server(explorer, '127.0.0.1', 0)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  driver = browser.headless_chromium()
  driver.get(f'http://127.0.0.1:{server.server_address[1]}/')
  browser.wait_for(driver, "document.body.dataset.ready === 'true'")
  browser.settled(driver, 0)
  yield driver, explorer
  driver.quit()
  server.shutdown()
  server.server_close()


def shown_matches_server_decode(driver, explorer, panel=0):
  state = driver.execute_script('return window.explorerState.panels')[panel]
  expected = to_pixels(explorer.decode([state['vector']], [state['cls']])[0]).ravel()
  shown = np.asarray(browser.canvas_pixels(driver, f'recon-canvas-{panel}'))
  np.testing.assert_array_equal(shown, expected)
  return state


def test_page_shows_the_first_test_image_and_its_prediction(page):
  driver, explorer = page
  shown = np.asarray(browser.canvas_pixels(driver, 'input-canvas'))
  np.testing.assert_array_equal(shown, to_pixels(explorer.images[0, ..., 0]).ravel())
  assert driver.find_element('id', 'prediction').text == str(explorer.predictions[0, 0])
  assert len(driver.find_elements('css selector', '#bars .bar-column')) == 10
  assert len(driver.find_elements('css selector', '.dim-slider')) == 16


def test_moving_a_slider_redraws_the_decode_of_the_perturbed_vector(page):
  from selenium.webdriver.common.keys import Keys  # pylint: disable=g-import-not-at-top
  driver, explorer = page
  before = driver.execute_script('return window.explorerState.panels[0]')
  renders = driver.execute_script('return window.explorerState.renders')
  slider = driver.find_element('id', 'slider-0-4')
  for _ in range(30):          # real key presses: the browser fires the input events itself
    slider.send_keys(Keys.ARROW_RIGHT)
  browser.settled(driver, renders)
  state = shown_matches_server_decode(driver, explorer)
  assert state['cls'] == before['cls']
  assert state['vector'][4] == pytest.approx(before['encoded'][4] + 30 * 0.005, abs=0.006)
  others = [d for d in range(16) if d != 4]
  np.testing.assert_allclose(np.asarray(state['vector'])[others], np.asarray(before['encoded'])[others])
  unperturbed = to_pixels(explorer.decode([before['encoded']], [before['cls']])[0]).ravel()
  assert np.any(np.asarray(browser.canvas_pixels(driver, 'recon-canvas-0')) != unperturbed)


def test_switching_the_class_capsule_decodes_that_capsule(page):
  driver, explorer = page
  current = driver.execute_script('return window.explorerState.panels[0].cls')
  other = (current + 3) % 10
  renders = driver.execute_script('return window.explorerState.renders')
  driver.find_element('css selector', f'#class-buttons-0 button[data-class="{other}"]').click()
  browser.settled(driver, renders)
  state = shown_matches_server_decode(driver, explorer)
  index = driver.execute_script('return window.explorerState.example.index')
  assert state['cls'] == other
  np.testing.assert_allclose(state['vector'], explorer.capsules[index, other], atol=1e-6)


def test_a_drawn_stroke_gets_a_prediction(page, tmp_path):
  from selenium.webdriver.common.action_chains import ActionChains  # pylint: disable=g-import-not-at-top
  driver, explorer = page
  canvas = driver.find_element('id', 'draw-canvas')
  driver.execute_script('arguments[0].scrollIntoView()', canvas)
  renders = driver.execute_script('return window.explorerState.renders')
  actions = ActionChains(driver).move_to_element_with_offset(canvas, 0, -70).click_and_hold()
  for _ in range(14):         # a vertical stroke: a "1"
    actions.move_by_offset(0, 10)
  actions.release().perform()
  browser.wait_for(driver, "document.getElementById('input-name').textContent === 'your drawing'")
  browser.settled(driver, renders)
  prediction = driver.find_element('id', 'prediction').text
  assert prediction in [str(c) for c in range(10)]
  drawn = np.asarray(browser.canvas_pixels(driver, 'input-canvas')).reshape(28, 28)
  rows, cols = np.nonzero(drawn > 127)
  assert rows.max() - rows.min() + 1 >= 19 and cols.max() - cols.min() + 1 <= 8   # a tall thin stroke
  assert prediction == '1'
  shown_matches_server_decode(driver, explorer)
  driver.execute_script('window.scrollTo(0, 0)')
  assert driver.save_screenshot(str(tmp_path / 'explorer.png'))
  assert (tmp_path / 'explorer.png').stat().st_size > 20000
