"""Plain English words for task keys and word lists (a fixed list, so tasks need no download)."""

WORDS = tuple(
    """
    acorn actor album alley amber angle ankle apple apron arch arrow atlas attic autumn award axis bacon badge
    bagel ballet bamboo banana banjo banner barley barn basket beach beacon beard beetle bell bench berry bicycle
    blanket blossom boat bonnet border bottle boulder bracelet branch bread breeze brick bridge bronze broom bubble
    bucket buffalo bugle butter button cabin cable cactus camel camera canal candle canoe canvas canyon captain
    carpet carrot castle cattle cedar cellar chalk chapel cherry chess chimney circus citrus clarinet cliff clock
    cloud clover coconut collar comet compass copper coral cotton cougar cradle crater crayon cricket crown crystal
    cupboard curtain cushion daisy dancer desert diamond dinner doctor dolphin donkey dragon drawer drum eagle
    easel echo eclipse elbow elephant elm emerald engine falcon feather fence ferry fiddle field finch flag flute
    forest fossil fountain fox galaxy garden garlic gazelle geyser ginger giraffe glacier glove goblet gondola
    goose granite grape gravel guitar hammer harbor harp harvest hazel helmet heron hickory honey horizon horse
    island ivory jacket jaguar jasmine jelly jigsaw journal jungle kayak kernel kettle kitten kiwi ladder lagoon
    lantern laptop lava lemon leopard lettuce library lily linen lizard lobster locket lotus magnet mango maple
    marble meadow melon meteor mirror mitten monkey mosaic mountain muffin mushroom napkin nectar needle nest
    noodle oasis ocean olive onion orange orbit orchard orchid otter owl oyster paddle palace panda panther paper
    parrot pasta peach peanut pebble pencil pepper piano pickle pillow pilot pine planet plum pocket pond poppy
    potato prairie pumpkin puzzle quartz quill rabbit radish rainbow raven ribbon river robin rocket saddle
    saffron salmon sandal satin saucer scarf seashell shadow shovel silver sketch sled slipper snail sparrow
    spider spinach sponge squirrel stable statue stove straw summit sunset swan sweater table tangerine teapot
    temple thimble thistle thunder tiger timber tomato topaz tractor trumpet tulip tundra turnip turtle umbrella
    valley vase velvet violin volcano wagon walnut walrus whistle willow window wizard yacht yogurt zebra zephyr
    """.split()
)

# Adjectives for RULER's needle keys, which are adjective-noun pairs ("abundant-hat"; RULER draws them from
# wonderwords' lists, which this fixed list stands in for).
ADJECTIVES = tuple(
    """
    abundant agile ancient anxious bashful bitter bold brave breezy bright brisk broad bumpy busy calm careful
    cheerful chilly clever cloudy clumsy cosy crisp curious damp dapper dazzling delicate dense dizzy drowsy dusty
    eager early earnest elegant empty fancy fearless feeble fierce fluffy fragile frank fresh frosty funny gentle
    giant glad gleaming glossy golden graceful grand greedy grumpy handsome happy hasty hearty heavy hollow humble
    hungry icy idle jolly jumpy keen kind lanky large lavish lazy lively lofty lonely loud lucky lush majestic
    mellow merry mighty misty modest muddy narrow neat nervous nimble noisy odd orange patient plain pleasant
    plucky polite proud purple quaint quick quiet rapid rare rough round royal rustic sandy scarlet shaggy sharp
    shiny shy silent silky simple sleepy slender slim smooth snowy soft sparkling spicy spotted steady stormy
    sturdy sunny swift tall tame tender thirsty tidy tiny tranquil tricky vast velvety vivid warm wary wealthy
    wide wild windy wise witty wooden young zany zealous
    """.split()
)
