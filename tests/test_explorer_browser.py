"""The explorer page in a real browser (headless Chromium): it loads, a slider moves the
reconstruction to the server-side decode of the perturbed vector, a drawn stroke gets a
prediction, and switching the class capsule decodes that capsule. Never skipped: CI
installs Chromium (.ci/run)."""
import os
import threading

import numpy as np
import pytest
from PIL import Image

from capsjax.app.explorer.backend import Explorer, to_pixels
from capsjax.app.explorer.server import make_server
from capsjax.app.explorer import browser


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
  assert len(driver.find_elements('css selector', '#bars .bar-row')) == 10
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
  # A photo of a "1" in ink on paper, opened: named with what predict says of it.
  page_photo = np.full((60, 40), 220, np.uint8)
  page_photo[10:50, 18:23] = 30
  Image.fromarray(page_photo).save(tmp_path / 'one.png')
  driver.find_element('id', 'file-input').send_keys(str(tmp_path / 'one.png'))
  browser.wait_for(driver, "document.getElementById('input-name').textContent.startsWith('one.png')")
  assert driver.find_element('id', 'input-name').text == (
      "one.png (laid out as MNIST's digits; dark on light: inverted first)")
  driver.execute_script('window.scrollTo(0, 0)')
  assert driver.save_screenshot(str(tmp_path / 'explorer.png'))
  assert (tmp_path / 'explorer.png').stat().st_size > 20000


def test_a_run_of_100_classes_with_long_names_shows_every_class_named(page, tmp_path):
  """100 classes of 30-character names (a photo collection, not digits): every class has a
  row with its whole name and a bar, the class lists name them, the words are neutral; an
  image file opened on the page is shown and classified as the server converts it."""
  import jax  # pylint: disable=g-import-not-at-top
  from capsjax import assemble  # pylint: disable=g-import-not-at-top
  from capsjax.app.trained import TrainedModel  # pylint: disable=g-import-not-at-top
  from capsjax.experiments import explorer as explorer_experiment  # pylint: disable=g-import-not-at-top
  driver, _ = page
  config = explorer_experiment.get_config()
  config.dataset = 'my_photos'
  config.model.num_classes = 100
  config.model.conv1_channels, config.model.primary_types, config.model.decoder_hidden = 16, 2, (32, 64)
  config.model.input_shape = (20, 20, 1)   # photos, not drawable
  config.class_names = tuple(f'{i:03d} a rather long class name xy'[:30] for i in range(100))
  model = assemble.model(config)
  params = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 20, 20, 1), np.float32))['params']
  rng = np.random.default_rng(0)
  many = Explorer(TrainedModel(config, model, params, 'a 100-class run'),
                  rng.random((8, 20, 20, 1), np.float32), rng.integers(0, 100, 8))
  server = make_server(many, '127.0.0.1', 0)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    driver.get(f'http://127.0.0.1:{server.server_address[1]}/')
    browser.wait_for(driver, "document.body.dataset.ready === 'true'")
    rows = driver.execute_script('''
      return [...document.querySelectorAll('#bars .bar-name')].map((name) => {
        const bar = name.parentElement.querySelector('.bar');
        return [name.textContent, name.scrollWidth <= name.clientWidth + 1, name.getBoundingClientRect().width,
                bar.getBoundingClientRect().width, bar.getBoundingClientRect().height];
      });''')
    assert [row[0] for row in rows] == list(config.class_names)
    assert all(whole and name_width > 100 and bar_height > 0 for _, whole, name_width, _, bar_height in rows)
    predicted = int(many.predictions[0, 0])
    assert rows[predicted][3] >= 2   # the predicted class has a visible bar
    in_view = driver.execute_script('''
      const list = document.getElementById('bars').getBoundingClientRect();
      const row = document.querySelectorAll('#bars .bar-name')[arguments[0]].getBoundingClientRect();
      return row.top >= list.top && row.bottom <= list.bottom;''', predicted)
    assert in_view
    for select in ('class-select', 'class-choice-0'):
      options = driver.execute_script(f"return [...document.getElementById('{select}').options].map(o => o.text)")
      assert options == list(config.class_names)
    text = driver.find_element('tag name', 'body').text
    assert 'digit' not in text.lower() and 'how the input is drawn' in text
    assert not driver.find_element('id', 'draw-box').is_displayed()
    photo = tmp_path / 'photo.png'   # colour, 60×40: converted to the run's grey 20×20
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(photo)
    driver.find_element('id', 'file-input').send_keys(str(photo))
    browser.wait_for(driver, "document.getElementById('input-name').textContent === 'photo.png'")
    shown = driver.execute_script('return window.explorerState.example')
    expected = many.encode_file(photo.read_bytes())
    assert shown['image'] == expected['image'] and shown['prediction'] == expected['prediction']
    assert browser.canvas_pixels(driver, 'input-canvas') == expected['image']
    (tmp_path / 'notes.png').write_text('not a picture')   # the page says why, the input stays
    driver.find_element('id', 'file-input').send_keys(str(tmp_path / 'notes.png'))
    browser.wait_for(driver, "!document.getElementById('error').classList.contains('hidden')")
    assert driver.find_element('id', 'error').text == 'notes.png: the file: not an image (Pillow reads PNG, ' \
        'JPEG and other image formats)'
    assert driver.find_element('id', 'input-name').text == 'photo.png'
  finally:
    server.shutdown()
    server.server_close()
