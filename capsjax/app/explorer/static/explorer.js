// The capsule explorer page. Every number comes from the server (capsjax/app/explorer/server.py):
// the page only draws; encoding and decoding run in JAX there, through the model's own
// encode / decode. One slider request is in flight at a time; newer slider values wait and
// go together with the next one, so the image never lags behind a queue.
'use strict';

const state = {
  info: null,
  example: null,        // the current input: {image, lengths, activations, capsules, prediction, label?}
  panels: [],           // per capsule panel: {cls, encoded: [dim], vector: [dim]}
  wide: false,
  inFlight: false,
  pending: false,
  pendingSince: null,   // performance.now() of the oldest slider event not yet sent
  renders: 0,
  latencies: [],
  misclassifiedCursor: -1,
};
window.explorerState = state;   // read by the browser test

const $ = (id) => document.getElementById(id);
const COLORS = ['#e53935', '#43a047'];
const SEGMENTATION_THRESHOLD = 0.1 * 255;   // as capsjax.app.programs.segmentation
const MAX_CLASS_BUTTONS = 12;               // more classes: a list of names instead of buttons


// A class's name from the run (its data's class names), or its index.
function className(cls) {
  const names = state.info && state.info.class_names;
  return names && names[cls] !== undefined ? names[cls] : String(cls);
}
function showError(message) {
  const box = $('error');
  box.textContent = message;
  box.classList.toggle('hidden', !message);
}

// GET without a body; POST a value as JSON, or an ArrayBuffer (a file's bytes) as it is.
async function api(path, body) {
  const raw = body instanceof ArrayBuffer;
  const options = body === undefined ? {} : {
    method: 'POST', headers: {'Content-Type': raw ? 'application/octet-stream' : 'application/json'},
    body: raw ? body : JSON.stringify(body)};
  const response = await fetch(path, options);
  if (!response.ok) {
    let message = `${response.status}`;
    try { message = (await response.json()).error; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

// ------------------------------------------------------------------------- drawing images

// Row-major values from the server: one per pixel (grey) or three (interleaved RGB).
function drawImage(canvas, pixels) {
  const context = canvas.getContext('2d');
  const image = context.createImageData(canvas.width, canvas.height);
  const channels = pixels.length / (canvas.width * canvas.height);
  for (let i = 0; i < canvas.width * canvas.height; i++) {
    for (let c = 0; c < 3; c++) image.data[4 * i + c] = pixels[channels * i + (channels === 3 ? c : 0)];
    image.data[4 * i + 3] = 255;
  }
  context.putImageData(image, 0, 0);
}

function drawRGB(canvas, red, green) {
  const context = canvas.getContext('2d');
  const image = context.createImageData(canvas.width, canvas.height);
  for (let i = 0; i < red.length; i++) {
    image.data[4 * i] = red[i];
    image.data[4 * i + 1] = green[i];
    image.data[4 * i + 2] = 0;
    image.data[4 * i + 3] = 255;
  }
  context.putImageData(image, 0, 0);
}

function segmentation(first, second) {
  const red = new Uint8Array(first.length), green = new Uint8Array(first.length);
  for (let i = 0; i < first.length; i++) {
    if (Math.max(first[i], second[i]) > SEGMENTATION_THRESHOLD) {
      if (first[i] >= second[i]) red[i] = 255; else green[i] = 255;
    }
  }
  return [red, green];
}

// ------------------------------------------------------------------------- capsule lengths

function renderBars() {
  const bars = $('bars');
  bars.innerHTML = '';
  // The bars show the routing's activations (for Procedure 1, the capsule lengths).
  const {activations: lengths, prediction} = state.example;
  const labels = state.example.label === undefined ? [] : [].concat(state.example.label);
  const chosen = state.panels.map((panel) => panel.cls);
  let predictedRow = null;
  lengths.forEach((length, cls) => {
    const row = document.createElement('div');
    row.className = 'bar-row';
    row.dataset.class = cls;
    row.title = `class ${className(cls)}: activation ${length.toFixed(3)}`;
    const name = document.createElement('div');
    name.className = 'bar-name' + (labels.includes(cls) ? ' label' : '');
    name.textContent = className(cls);
    const slot = chosen.indexOf(cls);
    if (slot >= 0) name.style.borderColor = state.info.mode === 'multimnist' ? COLORS[slot] : '#1e88e5';
    const track = document.createElement('div');
    track.className = 'bar-track';
    const bar = document.createElement('div');
    bar.className = 'bar' + (prediction.includes(cls) ? ' predicted' : '');
    bar.style.width = `${Math.min(100, Math.max(0, length * 100))}%`;
    track.append(bar);
    const value = document.createElement('div');
    value.className = 'bar-value';
    value.textContent = length.toFixed(2);
    for (const cell of [name, track, value]) {
      cell.addEventListener('click', () => switchClass(0, cls));
      cell.dataset.class = cls;
      row.append(cell);
    }
    if (prediction[0] === cls) predictedRow = name;
    bars.append(row);
  });
  // The predicted class in view (a long list scrolls), without moving the page.
  if (predictedRow && bars.scrollHeight > bars.clientHeight) {
    bars.scrollTop = predictedRow.offsetTop - bars.offsetTop - bars.clientHeight / 2;
  }
}

// ------------------------------------------------------------------------- sliders

function sliderRange() {
  return state.wide ? state.info.wide_slider_range : state.info.slider_range;
}

function buildPanels() {
  const container = $('capsule-panels');
  container.innerHTML = '';
  state.panels.forEach((panel, p) => {
    const box = document.createElement('div');
    box.className = 'capsule-panel';
    const multi = state.info.mode === 'multimnist';
    const [h, w] = state.info.image_shape;
    box.innerHTML = `
      <div class="row">
        <canvas id="recon-canvas-${p}" class="digit" width="${w}" height="${h}"></canvas>
        <div>
          <div class="panel-title" style="color:${multi ? COLORS[p] : 'inherit'}">
            reconstruction from capsule <b id="panel-class-${p}"></b></div>
          <div class="class-buttons" id="class-buttons-${p}"></div>
        </div>
      </div>
      <div class="sliders" id="sliders-${p}"></div>`;
    container.append(box);
    const buttons = box.querySelector(`#class-buttons-${p}`);
    if (state.info.num_classes <= MAX_CLASS_BUTTONS) {
      for (let cls = 0; cls < state.info.num_classes; cls++) {
        const button = document.createElement('button');
        button.textContent = className(cls);
        button.dataset.class = cls;
        button.addEventListener('click', () => switchClass(p, cls));
        buttons.append(button);
      }
    } else {   // many classes: one list of names
      const choice = document.createElement('select');
      choice.className = 'class-choice';
      choice.id = `class-choice-${p}`;
      for (let cls = 0; cls < state.info.num_classes; cls++) choice.add(new Option(className(cls), cls));
      choice.addEventListener('change', () => switchClass(p, Number(choice.value)));
      buttons.append(choice);
    }
    const sliders = box.querySelector(`#sliders-${p}`);
    for (let d = 0; d < state.info.dim; d++) {
      const row = document.createElement('label');
      row.className = 'slider-row';
      row.innerHTML = `<span class="dim">${d}</span>
        <input type="range" class="dim-slider" id="slider-${p}-${d}" data-panel="${p}" data-dim="${d}" step="0.005">
        <span class="slider-value" id="slider-value-${p}-${d}"></span>`;
      row.querySelector('input').addEventListener('input', (event) => onSlider(p, d, event));
      sliders.append(row);
    }
  });
  syncPanels();
}

function syncPanels() {
  const range = sliderRange();
  state.panels.forEach((panel, p) => {
    $(`panel-class-${p}`).textContent = className(panel.cls);
    document.querySelectorAll(`#class-buttons-${p} button`).forEach((button) => {
      button.classList.toggle('active', Number(button.dataset.class) === panel.cls);
    });
    const choice = $(`class-choice-${p}`);
    if (choice) choice.value = panel.cls;
    panel.vector.forEach((value, d) => {
      const slider = $(`slider-${p}-${d}`);
      slider.min = (panel.encoded[d] - range).toFixed(4);
      slider.max = (panel.encoded[d] + range).toFixed(4);
      slider.value = value;
      $(`slider-value-${p}-${d}`).textContent = formatDelta(value - panel.encoded[d]);
    });
  });
}

function formatDelta(delta) {
  return (delta >= 0 ? '+' : '−') + Math.abs(delta).toFixed(3);
}

function onSlider(p, d, event) {
  const value = Number(event.target.value);
  state.panels[p].vector[d] = value;
  $(`slider-value-${p}-${d}`).textContent = formatDelta(value - state.panels[p].encoded[d]);
  if (state.pendingSince === null) state.pendingSince = event.timeStamp || performance.now();
  requestDecode();
}

function switchClass(p, cls) {
  if (!state.example || p >= state.panels.length) return;
  const encoded = state.example.capsules[cls].slice();
  state.panels[p] = {cls, encoded, vector: encoded.slice()};
  syncPanels();
  renderBars();
  requestDecode();
}

function resetVectors() {
  state.panels.forEach((panel) => { panel.vector = panel.encoded.slice(); });
  syncPanels();
  requestDecode();
}

// ------------------------------------------------------------------------- decoding

function requestDecode() {
  if (state.inFlight) { state.pending = true; return; }
  decodeNow();
}

async function decodeNow() {
  state.inFlight = true;
  state.pending = false;
  const since = state.pendingSince;
  state.pendingSince = null;
  const vectors = state.panels.map((panel) => panel.vector.slice());
  const classes = state.panels.map((panel) => panel.cls);
  try {
    const answer = await (await api('/api/decode', {vectors, classes})).json();
    answer.pixels.forEach((pixels, p) => drawImage($(`recon-canvas-${p}`), pixels));
    if (state.info.mode === 'multimnist') {
      drawRGB($('overlay-canvas'), answer.pixels[0], answer.pixels[1]);
      drawRGB($('segmentation-canvas'), ...segmentation(answer.pixels[0], answer.pixels[1]));
    }
    state.shown = {vectors, classes, pixels: answer.pixels};
    if (since !== null) {
      const latency = performance.now() - since;
      state.latencies.push(latency);
      $('latency').textContent = `${latency.toFixed(1)} ms`;
    }
    state.renders += 1;
    document.body.dataset.renders = state.renders;
    showError('');
  } catch (error) {
    showError(`decode failed: ${error.message}`);
  } finally {
    state.inFlight = false;
    if (state.pending) decodeNow();
  }
}

// ------------------------------------------------------------------------- inputs

function setExample(example, name) {
  state.example = example;
  drawImage($('input-canvas'), example.image);
  const labels = example.label === undefined ? null : [].concat(example.label);
  $('label').textContent = labels === null ? '–' : labels.map(className).join(', ');
  $('prediction').textContent = example.prediction.map(className).join(', ');
  $('prediction').classList.toggle('wrong',
      labels !== null && labels.slice().sort().join() !== example.prediction.slice().sort().join());
  $('input-name').textContent = name;
  state.panels = example.prediction.map((cls) => {
    const encoded = example.capsules[cls].slice();
    return {cls, encoded, vector: encoded.slice()};
  });
  if (document.querySelectorAll('.capsule-panel').length !== state.panels.length) buildPanels();
  else syncPanels();
  renderBars();
  $('grid-image').classList.add('hidden');
  $('grid-download').classList.add('hidden');
  requestDecode();
}

async function showIndex(index) {
  try {
    const example = await (await api(`/api/example?index=${index}`)).json();
    $('index-input').value = index;
    setExample(example, `test image ${index}`);
  } catch (error) {
    showError(error.message);
  }
}

function randomIndex(candidates) {
  return candidates[Math.floor(Math.random() * candidates.length)];
}

function indicesOfClass(cls) {
  const out = [];
  state.info.labels.forEach((label, i) => { if ([].concat(label).includes(cls)) out.push(i); });
  return out;
}

async function classifyDrawing() {
  const canvas = $('draw-canvas');
  const rgba = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  let binary = '';
  for (let i = 0; i < rgba.length; i += 4) binary += String.fromCharCode(rgba[i]);
  try {
    const example = await (await api('/api/encode', {
      width: canvas.width, height: canvas.height, pixels: btoa(binary)})).json();
    setExample(example, 'your drawing');
  } catch (error) {
    showError(error.message);
  }
}

// An image file from this computer: its bytes go to the server, which converts them as
// capsjax.app.predict converts a file (one conversion, in Python) and encodes the result.
async function classifyFile(file) {
  try {
    const example = await (await api('/api/encode_file', await file.arrayBuffer())).json();
    // As capsjax-predict says them: a photo laid out as MNIST's digits, ink on paper inverted
    // first; no ink, no meaningful class.
    const notes = [example.fitted && "laid out as MNIST's digits",
                   example.inverted && 'dark on light: inverted first',
                   example.blank && 'blank: its class means nothing'].filter(Boolean);
    setExample(example, notes.length ? `${file.name} (${notes.join('; ')})` : file.name);
  } catch (error) {
    showError(`${file.name}: ${error.message}`);
  }
}

function setUpDrawing() {
  const canvas = $('draw-canvas');
  const context = canvas.getContext('2d');
  const clear = () => { context.fillStyle = 'black'; context.fillRect(0, 0, canvas.width, canvas.height); };
  clear();
  context.strokeStyle = 'white';
  context.lineWidth = 20;
  context.lineCap = context.lineJoin = 'round';
  let drawing = false;
  const point = (event) => {
    const box = canvas.getBoundingClientRect();
    return [(event.clientX - box.left) * canvas.width / box.width,
            (event.clientY - box.top) * canvas.height / box.height];
  };
  canvas.addEventListener('pointerdown', (event) => {
    drawing = true;
    canvas.setPointerCapture(event.pointerId);
    context.beginPath();
    context.moveTo(...point(event));
    context.lineTo(...point(event));
    context.stroke();
  });
  canvas.addEventListener('pointermove', (event) => {
    if (!drawing) return;
    context.lineTo(...point(event));
    context.stroke();
  });
  const finish = () => { if (drawing) { drawing = false; classifyDrawing(); } };
  canvas.addEventListener('pointerup', finish);
  canvas.addEventListener('pointercancel', finish);
  $('clear-drawing').addEventListener('click', clear);
  $('classify-drawing').addEventListener('click', classifyDrawing);
}

async function makeGrid() {
  const panel = state.panels[0];
  $('grid-status').textContent = 'drawing…';
  try {
    const blob = await (await api('/api/grid', {vector: panel.vector, class: panel.cls})).blob();
    const url = URL.createObjectURL(blob);
    $('grid-image').src = url;
    $('grid-image').classList.remove('hidden');
    const link = $('grid-download');
    link.href = url;
    link.download = `capsule_${panel.cls}_grid.png`;
    link.classList.remove('hidden');
    $('grid-status').textContent = '';
  } catch (error) {
    $('grid-status').textContent = '';
    showError(`grid failed: ${error.message}`);
  }
}

// ------------------------------------------------------------------------- start

async function start() {
  try {
    state.info = await (await api('/api/info')).json();
  } catch (error) {
    showError(`cannot reach the explorer server: ${error.message}`);
    return;
  }
  const info = state.info;
  document.body.classList.add(`mode-${info.mode}`);
  $('source').textContent = `${info.experiment} · ${info.model} · ${info.num_examples} test inputs`;
  $('wide-value').textContent = info.wide_slider_range;
  const [h, w] = info.image_shape;
  $('input-canvas').width = w;
  $('input-canvas').height = h;
  $('index-input').max = info.num_examples - 1;
  for (let cls = 0; cls < info.num_classes; cls++) $('class-select').add(new Option(className(cls), cls));
  $('capsule-dim').textContent = info.dim;
  document.querySelector('.facts').classList.toggle('long-names', info.class_names.some((n) => n.length > 4));
  // Digits only where the run's classes are the ten digits; otherwise neutral words.
  if (!info.digits) {
    document.querySelectorAll('.thing').forEach((span) => { span.textContent = 'input'; });
    $('draw-what').textContent = 'one';
    $('draw-as-mnist').textContent = '';   // the preprocessing is MNIST's; this run's images are not MNIST
  }
  $('misclassified-count').textContent = `${info.misclassified.length} of ${info.num_examples}`;
  $('next-misclassified').disabled = !info.misclassified.length;
  $('multi-views').classList.toggle('hidden', info.mode !== 'multimnist');
  $('draw-box').classList.toggle('hidden', !info.can_draw);
  $('go').addEventListener('click', () => showIndex(Number($('index-input').value)));
  $('index-input').addEventListener('keydown', (e) => { if (e.key === 'Enter') $('go').click(); });
  $('random').addEventListener('click', () => showIndex(Math.floor(Math.random() * info.num_examples)));
  $('random-of-class').addEventListener('click', () => {
    const candidates = indicesOfClass(Number($('class-select').value));
    if (candidates.length) showIndex(randomIndex(candidates));
    else showError('no test input of that class');
  });
  $('next-misclassified').addEventListener('click', () => {
    state.misclassifiedCursor = (state.misclassifiedCursor + 1) % info.misclassified.length;
    showIndex(info.misclassified[state.misclassifiedCursor]);
  });
  $('wide-range').addEventListener('change', (event) => { state.wide = event.target.checked; syncPanels(); });
  $('reset').addEventListener('click', resetVectors);
  $('make-grid').addEventListener('click', makeGrid);
  if (info.can_draw) setUpDrawing();
  $('file-box').classList.toggle('hidden', !info.can_open_files);
  $('file-shape').textContent = `${w}×${h}`;
  $('file-input').addEventListener('change', (event) => {
    const file = event.target.files[0];
    if (file) classifyFile(file);
    event.target.value = '';   // the same file again is a new choice
  });
  await showIndex(0);
  document.body.dataset.ready = 'true';
}

start();
